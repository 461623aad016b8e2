"""The dev model server (vLLM's OpenAI contract over transformers), its generation, LoRA runtime and hot swap."""
