"""rltool: a CLI toolkit for RL post-training of language models."""
