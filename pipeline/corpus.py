"""Local English text: the calibration corpus of quantization, also used for prompts and tiny tokenizers."""

import pydoc_data.topics


def local_text(max_chars: int = 400_000) -> str:
    """English text that ships with every CPython (pydoc topics): for calibration, tokenizers, training and prompts."""
    return "\n".join(pydoc_data.topics.topics.values())[:max_chars]
