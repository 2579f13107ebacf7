"""The stages that build the embedded demo pair, one command each (see scripts/demo/README.md):

corpus -> tokenizer -> target -> responses -> drafter (`flashdraft train-drafter`) -> evaluate.
Every stage takes explicit sizes, a seed and a wall-clock cap, so the same code runs at toy scale on a CPU
(tests/test_demo_pipeline.py) and at full scale on one GPU (scripts/demo/gpu_pipeline.sh).
"""
