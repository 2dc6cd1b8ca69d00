"""What ranks send each other: point-to-point collectives, exchanges, differentiable gathers, the
head all-to-all, and the agreement every call starts with.
"""
