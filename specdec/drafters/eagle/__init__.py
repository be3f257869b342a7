"""EAGLE-3: the head (`head`), its checkpoints in the speculators / vLLM layout (`io`), the dynamic
tree drafter (`drafter`) and tree sizes timed on this machine (`auto`, `eagle:DIR@auto`)."""
