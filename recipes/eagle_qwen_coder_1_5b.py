"""Recipe: an EAGLE-3 head for qwen2.5-coder-1.5b-instruct, evaluated on HumanEval.

    python recipes/eagle_qwen_coder_1_5b.py --out runs/eagle_qwen15 --max-minutes 180

The same pipeline as recipes/eagle_smollm2.py (self-distillation -> cached aux-layer features ->
EAGLE-3 training with training-time test -> `specdec eval` with method eagle:OUT; every step
resumable with the same command, all inside --max-minutes, which may be spent in several runs),
with training prompts restricted to code questions among the ShareGPT calibration conversations
plus function stubs in HumanEval's shape (HumanEval itself is never trained on), and evaluation on
20 HumanEval problems through the chat template against plain decoding and `transformers`
generate() (OUT/eval/report.json, OUT/summary.json).
"""

from __future__ import annotations

from eagle_smollm2 import parser, pipeline
from recipe_errors import run

# the data settings of recipes/medusa_qwen_coder_1_5b.py (about 1 calibration conversation in 9
# opens with a code question: 120 read per budget minute; two thirds function stubs); 3 hours in
# all, the budget for the 1.5B, of which 25 minutes for the evaluation
DEFAULTS = {"out": "runs/eagle_qwen15", "max_minutes": 180.0, "answer_tokens": 256, "batch_size": 64,
            "prompts_per_minute": 120, "data_frac": 0.5, "eval_minutes": 25.0, "eval_prompts": 20,
            "eval_tokens": 128, "function_share": 0.67, "baselines": "plain,hf",
            "answers_frac": 0.0, "answer_records": 4000, "dataset_answer_tokens": 256}
# EagleTrainConfig's 32k draft vocabulary (the 16k-32k; 95% of the 1.5B's greedy ShareGPT
# answer tokens, specdec.drafters.draft_vocab); more epochs over the few hundred thousand positions a CPU caches
TRAIN = {"epochs": 8}

if __name__ == "__main__":
    p = parser(DEFAULTS, TRAIN, __doc__)
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct",
                   help="catalogue name (qwen2.5-coder-0.5b-instruct for a quick check)")
    p.add_argument("--all-prompts", dest="code_prompts", action="store_false",
                   help="train on every ShareGPT prompt, not only code questions")
    args = p.parse_args()
    run(lambda: pipeline(args, args.model, "humaneval", raw_eval=False))
