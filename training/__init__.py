"""Training of the embedded tiny model and its draft heads; not shipped.

python3 -m training.train_tiny --out OUT_DIR      # train (GPU), or --smoke on a CPU
python3 -m training.eval_tiny --out EVAL_DIR      # acceptance of the draft heads, simulated and in the engine
"""
