"""Hugging Face models on polytrain: pretrained weights, PEFT adapters, instruction data.

Nothing here is imported by ``import polytrain``; the subpackages import
``transformers`` / ``peft`` / ``datasets`` only where they need them.
"""
