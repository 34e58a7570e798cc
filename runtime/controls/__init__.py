"""kvforge.runtime.controls: what a request asks for: its options, sampling, penalties and grammars, log-probabilities, speculation, tools."""
