"""The typed recipe (one dataclass per section) and its OmegaConf loader."""
