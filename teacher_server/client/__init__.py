"""The trainer's side of the teacher: the ZeroMQ client, the OpenAI-compatible client, the launcher.

Imports no server module: a server is reached over the wire, or started as a subprocess (launcher.py).
"""
