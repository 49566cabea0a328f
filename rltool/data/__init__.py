"""Task datasets: question/answer records from local JSON Lines or Parquet files."""

from rltool.data.examples import REQUIRED_FIELDS, load_examples

__all__ = ["REQUIRED_FIELDS", "load_examples"]
