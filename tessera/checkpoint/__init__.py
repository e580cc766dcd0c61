"""Checkpoint formats the ecosystem reads: safetensors and Hugging Face export."""

from tessera.checkpoint.export import EXPORT_FORMATS, export_model

__all__ = ["EXPORT_FORMATS", "export_model"]
