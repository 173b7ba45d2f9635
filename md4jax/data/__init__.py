"""Text and generated data: corpora, tokenizers, token caches and the batch pipeline."""
