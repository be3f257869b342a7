"""Recovery of a 2:4-sparse model by distillation from its dense original, keeping its mask
(`train`: `RecoverConfig`, `recover`). The package attribute `distill.recover` is that function
(the public API); import the module as `distill.recover.train`."""
