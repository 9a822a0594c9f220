"""Other libraries' training loops and models, as they come (``docs/huggingface.md``)."""
