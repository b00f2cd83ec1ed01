"""Training of the embedded tiny model and its draft heads (scripts/train_tiny.py, scripts/eval_tiny.py).

Not shipped.
"""
