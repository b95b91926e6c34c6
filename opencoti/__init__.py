"""opencoti: an LLM inference engine and server for GGUF models.

Serves llama.cpp's HTTP API and the OpenAI API; runs on the CPU (NumPy) and,
in later work, CUDA (CuPy) and Vulkan.
"""

from opencoti.version import __version__, BUILD_TAG, full_version  # noqa: F401
