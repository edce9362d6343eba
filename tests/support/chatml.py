"""The prompts and the answer of the ChatML test models (tests/conftest.py's `chatml_models`): a student and a
teacher with the tokenizer real instruct models ship, the teacher taught to answer every prompt with TEACHER_ANSWER."""

TEACHER_ANSWER = "ok"
CHATML_PROMPTS = [f"rev:{w}" for w in ("abcde", "hello", "qwert", "zyxwv", "mnopq", "lkjhg", "asdfg", "poiuy")] + [
    "Please write one long sentence about water.",
    "What is the answer?",
    "Say hello to the world",
    "sum:31415",
]
