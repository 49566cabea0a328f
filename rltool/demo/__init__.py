"""The built-in demo: tiny GSM8K-format data, its tokenizer and the warm-started model."""
