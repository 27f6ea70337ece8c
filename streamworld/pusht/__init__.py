"""The embedded PushT world model: environment, scripted policy, data, training and evaluation.

The model itself is the `pusht` preset of `streamworld.models`; this package holds what is
specific to PushT (it needs the `gym-pusht` environment).
"""
