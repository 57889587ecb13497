"""rayzero.controller"""
