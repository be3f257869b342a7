"""Draft distillation (DistillSpec): the loop (`train`: `DistillConfig`, `distill_draft`), its
on-policy and target-written answers (`onpolicy`) and the held-out acceptance measurement
(`heldout`)."""
