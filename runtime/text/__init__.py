"""kvforge.runtime.text: text: the tokenizer, the vocabulary, chat templates and messages, prompt forms."""
