"""How a sequence is split over ranks: shardings and positions, what each split sends, and ring
dilated attention's plans.
"""
