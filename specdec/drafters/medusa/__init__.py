"""Medusa: heads on the target's last hidden state (`heads`), their candidate trees (`tree`), their
checkpoints in specdec's and vLLM's layouts (`io`), the drafter that decodes with them (`drafter`)
and the greedy tau of any tree replayed from one plain pass (`replay`)."""
