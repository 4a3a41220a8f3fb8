"""The 2.0 import path; the code lives in ``speedtronic.models.transformer``."""

from speedtronic.models.transformer import GPT as GPT
from speedtronic.models.transformer import CausalSelfAttention as CausalSelfAttention
from speedtronic.models.transformer import GPTConfig as GPTConfig
from speedtronic.models.transformer import GPTModel as GPTModel
from speedtronic.models.transformer import ReferenceModel as ReferenceModel
from speedtronic.models.transformer import ReferenceTransformer as ReferenceTransformer
from speedtronic.models.transformer import RMSNorm as RMSNorm
from speedtronic.models.transformer import RotaryEmbedding as RotaryEmbedding
from speedtronic.models.transformer import SwiGLU as SwiGLU
from speedtronic.models.transformer import Transformer as Transformer
from speedtronic.models.transformer import TransformerBlock as TransformerBlock
from speedtronic.models.transformer import TransformerConfig as TransformerConfig
from speedtronic.models.transformer import apply_rope as apply_rope
from speedtronic.models.transformer import (
    build_reference_transformer as build_reference_transformer,
)

__all__ = [
    "CausalSelfAttention",
    "GPT",
    "GPTConfig",
    "GPTModel",
    "RMSNorm",
    "ReferenceModel",
    "ReferenceTransformer",
    "RotaryEmbedding",
    "SwiGLU",
    "Transformer",
    "TransformerBlock",
    "TransformerConfig",
    "apply_rope",
    "build_reference_transformer",
]
