"""Evaluation: `specdec eval` (several decoding methods, alternating per prompt, on the same
prompts), its reports (JSON, Markdown, plots), the prompt sources, the baselines a user would pick
instead (transformers, llama.cpp) and `specdec bench`."""
