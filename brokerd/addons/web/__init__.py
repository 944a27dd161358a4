"""The optional read-only web dashboard (`[web] listen`): brokerd/addons/web/server.py serves it,
push.py streams changes to open pages, shapes.py builds what they show, static/ is the
page itself (plain files, no build step)."""
