"""Worker-process side: the llama.cpp engine, GGUF metadata, and device backends."""
