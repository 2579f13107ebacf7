"""GGUF quantized weights kept in their blocks: formats, torch dequantization, Linear/Embedding modules."""
from flashdraft.quant.dequant import dequantize
from flashdraft.quant.formats import QUANT_FORMATS, BlockFormat, UnsupportedQuantType, block_format
from flashdraft.quant.linear import QuantEmbedding, QuantLinear

__all__ = ["QUANT_FORMATS", "BlockFormat", "QuantEmbedding", "QuantLinear", "UnsupportedQuantType",
           "block_format", "dequantize"]
