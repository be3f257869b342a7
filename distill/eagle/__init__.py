"""EAGLE-3 heads trained with training-time test on the EAGLE-3 feature cache (`train`:
`EagleTrainConfig`, `train_eagle`); the head and its checkpoints are specdec.drafters.eagle's."""
