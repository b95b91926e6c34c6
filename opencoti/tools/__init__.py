"""Developer tools that are not part of serving: synthetic random-weight GGUF
models for parity tests (``synth_gguf``).

Modules here may import ``torch`` and ``transformers`` (the ``[dev]`` extra),
but only inside functions, so that ``import opencoti.tools`` works in the
shipped ``.pyz`` where those packages are absent.
"""
