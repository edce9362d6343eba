"""The wire between the trainer and the teacher server: typed messages, array frames and their codecs.

Both sides import it; it imports neither the server nor the client. protocol.py holds the messages and
frames, scores.py what a score request returns, conversation.py a text request's rendering,
idcodec.py and hidden_codec.py the compact encodings, identity.py the secret's token and the
tokenizer's fingerprint.
"""
