"""The teacher server: a frontend, replica processes, their supervisor, settings and scoring backends.

Started by `python -m teacher_server` (launch/start_teacher.sh); imports nothing of the trainer.
"""
