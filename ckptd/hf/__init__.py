"""Hugging Face safetensors in and out, torch-free: ``ckptd export`` / ``ckptd import`` and the
functions ``ckptd_client`` re-exports. Imports only ``ckptd.core`` (tests/test_layering.py)."""
from .export import ExportResult, OutputExists, export_hf
from .importer import ImportResult, import_hf

__all__ = ["export_hf", "ExportResult", "OutputExists", "import_hf", "ImportResult"]
