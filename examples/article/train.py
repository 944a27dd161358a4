# The vendor-agnostic article's train.py, unchanged but for its import lines: the article
# imports init_accelerator from its own `accelerate_core`, vaccel provides it; the
# article leaves get_dataloader() to the reader, model.py here gives it synthetic data.
#
#     vaccel run --gpus 1 -- python train.py
#     python -c "import vaccel, train; vaccel.lease()(train.main)()"
from vaccel import init_accelerator
from model import MedicalSegmentationModel, get_dataloader
import torch
import torch.nn.functional as F

def main():
    # 初始化加速器（自动探测环境）
    accelerator = init_accelerator()
    print(f"Using accelerator: {accelerator.backend}")

    # 创建模型和数据（不指定device）
    model = MedicalSegmentationModel()
    dataloader = get_dataloader()  # 返回未to_device的数据

    # Accelerator自动处理设备迁移和DDP
    model, dataloader = accelerator.prepare(model, dataloader)
    optimizer = torch.optim.Adam(model.parameters())

    for epoch in range(10):
        for batch in dataloader:
            inputs, targets = batch
            outputs = model(inputs)
            loss = F.cross_entropy(outputs, targets)

            # 统一的backward和step
            accelerator.backward(loss)
            accelerator.step(optimizer)
            optimizer.zero_grad()

        # 所有进程同步后打印loss
        if accelerator.is_main_process:
            print(f"Epoch {epoch}, Loss: {loss.item():.4f}")

if __name__ == "__main__":
    main()
