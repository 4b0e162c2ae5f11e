"""The loop spellings models use to run their blocks under a checkpoint or not, a flag of the
model deciding: an if/else statement, a conditional expression, a method of the model, and a
method that returns early. ``FLAGGED_LOOPS`` names them; ``flagged_loop(name, checkpointing)``
builds one (``CheckpointedStack``'s blocks, tok, final_norm and head)."""

from torch.utils.checkpoint import checkpoint

from normfuse.zoo import CheckpointedStack


class IfElseLoop(CheckpointedStack):
    checkpointing = True

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.blocks:
            if self.checkpointing:
                x = checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        return self.head(self.final_norm(x))


class ConditionalExpressionLoop(CheckpointedStack):
    checkpointing = True

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.blocks:
            x = checkpoint(layer, x, use_reentrant=False) if self.checkpointing else layer(x)
        return self.head(self.final_norm(x))


class HelperMethodLoop(CheckpointedStack):
    checkpointing = True

    def run_layer(self, layer, hidden):
        if self.checkpointing:
            return checkpoint(layer, hidden, use_reentrant=False)
        return layer(hidden)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.blocks:
            x = self.run_layer(layer, x)
        return self.head(self.final_norm(x))


class EarlyReturnLoop(HelperMethodLoop):
    """HF's older spelling: checkpoint only while training, decided before the plain call."""

    def run_layer(self, layer, hidden):
        if not (self.checkpointing and self.training):
            return layer(hidden)
        return checkpoint(layer, hidden, use_reentrant=False)


FLAGGED_LOOPS = {"if_else": IfElseLoop, "conditional_expression": ConditionalExpressionLoop,
                 "helper_method": HelperMethodLoop, "early_return": EarlyReturnLoop}


def flagged_loop(name: str, checkpointing: bool, **kwargs) -> CheckpointedStack:
    model = FLAGGED_LOOPS[name](**kwargs)
    model.checkpointing = checkpointing
    return model


class ReentrantIfElseLoop(IfElseLoop):
    """A reentrant checkpoint behind the flag: a pair going into it would be hidden from autograd."""

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.blocks:
            if self.checkpointing:
                x = checkpoint(layer, x, use_reentrant=True)
            else:
                x = layer(x)
        return self.head(self.final_norm(x))
