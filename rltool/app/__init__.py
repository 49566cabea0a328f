"""The application: builds a run from a recipe and drives its steps (``rltool train``)."""
