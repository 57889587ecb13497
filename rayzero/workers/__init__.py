"""rayzero.workers"""
