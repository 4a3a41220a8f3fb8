"""Downstream evaluation of language models: the run's text (encode and decode with its
tokenizer), multiple-choice in-context tasks, and the samples a model writes."""
