"""The wire between the trainer and the teacher server: typed messages, array frames and their codecs.

Both sides import it; it imports neither the server nor the client. protocol.py holds the messages (the
header frames), score_frames.py a score request's and reply's array frames, scores.py what a score request
returns, conversation.py a text request's rendering, idcodec.py and hidden_codec.py the compact encodings,
identity.py the secret's token and the tokenizer's fingerprint.
"""
