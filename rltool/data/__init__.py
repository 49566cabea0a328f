"""Task datasets: records from JSON Lines, Parquet or saved ``datasets`` directories,
each mapped to one canonical row."""

from rltool.data.examples import REQUIRED_FIELDS, load_examples, load_located
from rltool.data.mapping import PRESETS, FieldMap, field_map

__all__ = ["PRESETS", "REQUIRED_FIELDS", "FieldMap", "field_map", "load_examples", "load_located"]
