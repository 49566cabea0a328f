"""Task datasets: question/answer records from local JSON Lines or Parquet files."""

from rltool.data.examples import REQUIRED_FIELDS, load_examples
from rltool.data.mapping import PRESETS, FieldMap, field_map

__all__ = ["PRESETS", "REQUIRED_FIELDS", "FieldMap", "field_map", "load_examples"]
