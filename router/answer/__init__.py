"""The client's answer across legs: the answer so far (`progress`), the streamed rewrite
under one id (`shaper`), the non-streaming body (`assembly`), logprobs and usage across
legs, held finish chunks.

May import admission (the request's spec), engine (the wire format) and the leaves.
"""
