"""What times and chooses, above the drafters: the draft length of `auto` (autok.py), verification
costs and the cut of a proposal (costs.py), the composite's gates (gates.py), the state drafters
learn across calls (state.py), tree sizes timed through generate() (tree_cost.py for Medusa,
eagle_tree.py for EAGLE-3's `@auto`) and the warm-ups before timed runs (warmup.py).

Drafters propose and commit; they read the estimators here (autok, costs, gates), and nothing in
`specdec.drafters` imports the modules that time through generate() (tree_cost, eagle_tree).
"""
