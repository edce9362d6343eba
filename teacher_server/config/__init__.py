"""The `teacher` section both sides read, the field helpers every config section declares with, model references.

fields.py is generic (the trainer's schema uses it too); teacher.py is the `teacher` section and its rules;
model_refs.py resolves a model given as a directory or a hub id.
"""
