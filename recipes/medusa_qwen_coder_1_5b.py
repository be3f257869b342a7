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

# tree size from the cost of a tree step on this CPU (bf16, eager, one row, BENCHMARKS.md section 4):
# 1.06x a plain step with 1 node, 1.19x with 16, 1.23x with 24, then 1.59x with 32 and 1.82x with
# 48, so 1.8x plain needs tau >= ~2.2 at 24 nodes but ~3.3 at 48 (session 10's CPU: 1.92x at 24
# and 1.12x at 4, where 4 nodes paid best: `specdec medusa tree --num-nodes auto` picks the size
# for the machine at hand); about 1 conversation in 9 of the calibration split opens with a code
# question, so the pool reads 120 conversations per budget minute (60 left session 9's data phase
# short of prompts at 1526); 64 rows per generation batch: 4.4 s per answer on session 11's CPU
# (7.4 s with 32 rows before the GQA attention fix); the evaluation (tau on 32 problems in one
# batch, speed on 8) took 21 minutes in session 10
DEFAULTS = {"out": "runs/medusa_qwen15", "max_minutes": 240.0, "answer_tokens": 256, "batch_size": 64,
            "prompts_per_minute": 120, "num_layers": 1, "epochs": 8, "tree_nodes": 24, "data_frac": 0.5,
            "eval_minutes": 25.0, "eval_prompts": 32, "eval_tokens": 128, "speed_prompts": 8,
            "soft_targets": False, "speed_nodes": "auto", "function_share": 0.67,
            "max_vocab": 16384}

if __name__ == "__main__":
    p = parser(DEFAULTS, __doc__)
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct",
                   help="catalogue name (qwen2.5-coder-0.5b-instruct for a quick check)")
    p.add_argument("--all-prompts", dest="code_prompts", action="store_false",
                   help="train on every ShareGPT prompt, not only code questions")
    args = p.parse_args()
    pipeline(args, args.model, "humaneval", raw_eval=False)
