"""Recipe: Medusa heads for qwen2.5-coder-1.5b-instruct, evaluated on HumanEval.

    python recipes/medusa_qwen_coder_1_5b.py --out runs/medusa_qwen15 --max-minutes 240

The same pipeline as recipes/medusa_smollm2.py (self-distillation -> cached hidden states ->
Medusa-1 training -> evaluation; every step resumable, all inside --max-minutes), with training
prompts restricted to code questions among the ShareGPT calibration conversations (HumanEval
itself is never trained on) and evaluation on HumanEval through the chat template: tau and
equality with plain greedy decoding over `--eval-prompts` problems (OUT/tau.json), tokens/s
against plain decoding per problem with `specdec eval` (OUT/eval/report.json).
"""

from __future__ import annotations

from medusa_smollm2 import parser, pipeline
from recipe_errors import run

# about 1 conversation in 9 of the calibration split opens with a code question, so the pool reads
# 120 conversations per budget minute (60 ran out of prompts before the data phase ended); 64 rows
# per generation batch; the evaluation (tau on 32 problems in one batch, speed on 8) takes ~21
# minutes on a 2-core CPU (eval_minutes keeps 25; docs/medusa.md). A tree step's cost relative to a
# plain step differs several-fold between CPUs (BENCHMARKS.md section 5, "Measured bound"), so the
# speed comparison times the tree sizes on the machine at hand (speed_nodes "auto").
DEFAULTS = {"out": "runs/medusa_qwen15", "max_minutes": 240.0, "answer_tokens": 256, "batch_size": 64,
            "prompts_per_minute": 120, "num_layers": 1, "data_frac": 0.5, "eval_minutes": 25.0,
            "eval_prompts": 32, "eval_tokens": 128, "speed_prompts": 8, "speed_nodes": "auto",
            "function_share": 0.67}
# where this recipe trains differently from MedusaTrainConfig's defaults: vocab "data" with the 16384 most
# frequent answer tokens because the LM head's rows set the cost of a training step and of the heads'
# share of a decoding step (docs/medusa.md); 8 epochs, over the few hundred thousand positions a
# CPU budget caches, and a 24-node tree for tau.json, as in the recipe's first measured run
# (docs/medusa.md, "Results"; the tau table of BENCHMARKS.md section 5 passes --tree-nodes 64)
TRAIN = {"vocab": "data", "max_vocab": 16384, "epochs": 8, "tree_nodes": 24}

if __name__ == "__main__":
    p = parser(DEFAULTS, TRAIN, __doc__)
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct",
                   help="catalogue name (qwen2.5-coder-0.5b-instruct for a quick check)")
    p.add_argument("--all-prompts", dest="code_prompts", action="store_false",
                   help="train on every ShareGPT prompt, not only code questions")
    args = p.parse_args()
    run(lambda: pipeline(args, args.model, "humaneval", raw_eval=False))
