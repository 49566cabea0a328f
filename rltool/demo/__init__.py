"""The built-in demo: tiny GSM8K-format data and its tokenizer (the warm-started model is
built by ``rltool.app.demo_model``; ``builtin:`` paths resolve in ``rltool.builtin``)."""
