from flashdraft.layers.attention import Attention
from flashdraft.layers.elementwise import RMSNorm, RotaryEmbedding
from flashdraft.layers.plan import LayerPlan

__all__ = ["Attention", "LayerPlan", "RMSNorm", "RotaryEmbedding"]
