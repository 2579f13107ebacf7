from flashdraft.layers.attention import Attention
from flashdraft.layers.decoder import DecoderLayer
from flashdraft.layers.mlp import GatedMLP
from flashdraft.layers.norm import RMSNorm
from flashdraft.layers.plan import LayerPlan
from flashdraft.layers.rope import RotaryEmbedding

__all__ = ["Attention", "DecoderLayer", "GatedMLP", "LayerPlan", "RMSNorm", "RotaryEmbedding"]
