"""Medusa-1 heads trained on the hidden-state cache (`train`: `MedusaTrainConfig`, `train_medusa`,
`head_accuracy`); the heads themselves, their trees and checkpoints are specdec.drafters.medusa's."""
