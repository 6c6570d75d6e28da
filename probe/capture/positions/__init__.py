"""What each position of a captured stack is, named after the forward: patches, tiles, merged grids, frames.

* :mod:`~.pictures`: one :class:`~.pictures.PictureLayout` per kind of pixel input, and the one
  switch that picks it (a cache's metadata, a forward's inputs, a generation's prompt);
* :mod:`~.patches`: a picture's patch grid and prefix tokens (``[batch, C, H, W]``: ViT, CLIP,
  DETR's feature map, Swin's stages), and a vision-language text's image tokens on it;
* :mod:`~.tiles`: Idefics3's tiles, each pixel-shuffled into merged tokens;
* :mod:`~.merged`: Qwen2-VL's pictures at their own sizes, ``m x m`` patches merged;
* :mod:`~.grids`: what they share: image tokens laid on grids, labelled, attached to the stacks
  over the text;
* :mod:`~.frames`: an audio encoder's positions as time spans, from its convolution front end.

A new layout of pixels is one :class:`~.pictures.PictureLayout` and its module here.
"""
