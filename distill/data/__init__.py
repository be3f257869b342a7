"""Training data shared by the methods: the target's own answers to ShareGPT prompts
(`selfdistill`), function-stub prompts cut from installed Python sources (`code_prompts`),
ShareGPT's own answers read teacher-forced (`dataset_answers`), and the feature cache that Medusa
and EAGLE-3 heads train on (`features`)."""
