//! What flows between a model's units: [`Activation`], a float tensor or a tuple of them,
//! and how it crosses between pipeline stages (as host parts, or as device tensors where
//! the stages' collectives read device memory).

use burn::tensor::{DType, Device, FloatDType, Gradients, Tensor, TensorData};
use zerotrain_precision::half::{bf16, f16};
use zerotrain_precision::{FlatBuf, with_elem};

use crate::{Error, Result};

/// What flows between units: a float tensor of any rank, or a tuple of up to three of
/// them. The engine detaches it at unit boundaries, and in backward seeds a unit's output
/// with the gradient of the next unit's input.
pub trait Activation: Clone + Send + Sized + 'static {
    /// How many tensors it is.
    const PARTS: usize;
    /// Cut from the graph that produced it, gradient tracking on: a leaf whose gradient
    /// [`grad`](Self::grad) reads after backward.
    fn leaf(self) -> Self;
    /// Cut from any graph, without gradient tracking (a checkpointed boundary).
    fn detached(self) -> Self;
    /// The gradient `grads` holds for this leaf (zeros for a part nothing depended on);
    /// `None` if no part has one.
    fn grad(&self, grads: &Gradients) -> Option<Self>;
    /// `sum(self * upstream)` over every part, with `upstream` treated as a constant: its
    /// backward pass back-propagates `upstream` through the graph that produced `self`.
    fn seed(self, upstream: Self) -> Tensor<1>;
    /// Bytes it holds.
    fn num_bytes(&self) -> u64;
    /// Its tensors as flat buffers with their shapes (to send to another pipeline stage);
    /// an error for a dtype other than f32, f16 and bf16.
    fn into_parts(self) -> Result<Vec<(FlatBuf, Vec<usize>)>>;
    /// The activation from [`PARTS`](Self::PARTS) parts, on `device`.
    fn from_parts(parts: &mut dyn Iterator<Item = (FlatBuf, Vec<usize>)>, device: &Device) -> Result<Self>;
    /// Its tensors flattened, without autodiff, with their shapes: what a pipeline sends
    /// between stages whose collectives read device memory (NCCL's), with no copy to the
    /// host. The default goes through [`into_parts`](Self::into_parts) onto `device`.
    fn into_tensors(self, device: &Device) -> Result<Vec<(Tensor<1>, Vec<usize>)>> {
        let device = device.clone().without_autodiff();
        let parts = self.into_parts()?.into_iter();
        Ok(parts.map(|(values, shape)| (super::flat::tensor(values, &device), shape)).collect())
    }
    /// The activation from [`PARTS`](Self::PARTS) such tensors, on `device`. The default
    /// reads them for [`from_parts`](Self::from_parts).
    fn from_tensors(parts: &mut dyn Iterator<Item = (Tensor<1>, Vec<usize>)>, device: &Device) -> Result<Self> {
        let host = parts
            .map(|(t, shape)| Ok((super::flat::Flat::Device(t).into_host("an activation")?, shape)))
            .collect::<Result<Vec<_>>>()?;
        Self::from_parts(&mut host.into_iter(), device)
    }
}

impl<const D: usize> Activation for Tensor<D> {
    const PARTS: usize = 1;

    fn leaf(self) -> Self {
        self.detach().require_grad()
    }

    fn detached(self) -> Self {
        self.detach().autodiff()
    }

    fn grad(&self, grads: &Gradients) -> Option<Self> {
        Tensor::grad(self, grads)
    }

    fn seed(self, upstream: Self) -> Tensor<1> {
        let upstream = upstream.detach();
        (self * upstream).sum()
    }

    fn num_bytes(&self) -> u64 {
        (self.shape().num_elements() * self.dtype().size()) as u64
    }

    fn into_parts(self) -> Result<Vec<(FlatBuf, Vec<usize>)>> {
        let shape = self.dims().to_vec();
        let data = super::readout::read(self, "an activation")?;
        let values = match data.dtype() {
            DType::F32 => data.try_into_vec::<f32>().map(FlatBuf::F32),
            DType::F16 => data.try_into_vec::<f16>().map(FlatBuf::F16),
            DType::BF16 => data.try_into_vec::<bf16>().map(FlatBuf::Bf16),
            other => return Err(Error::Model(format!("an activation of dtype {other:?} cannot pass between stages"))),
        };
        let values = values.map_err(|e| Error::Model(format!("activation data: {e:?}")))?;
        Ok(vec![(values, shape)])
    }

    fn from_parts(parts: &mut dyn Iterator<Item = (FlatBuf, Vec<usize>)>, device: &Device) -> Result<Self> {
        let (values, shape) =
            parts.next().ok_or_else(|| Error::Model("an activation arrived with too few parts".into()))?;
        let shape: [usize; D] = shape.as_slice().try_into().map_err(|_| {
            Error::Model(format!("an activation of rank {} arrived where rank {D} was expected", shape.len()))
        })?;
        if values.len() != shape.iter().product::<usize>() {
            return Err(Error::Model(format!("an activation of shape {shape:?} arrived with {} values", values.len())));
        }
        let data = with_elem!(FlatBuf, values, v, _E => TensorData::new(v, shape));
        let dtype = data.dtype();
        Ok(Tensor::from_data(data, (device, dtype)))
    }

    fn into_tensors(self, _: &Device) -> Result<Vec<(Tensor<1>, Vec<usize>)>> {
        let shape = self.dims().to_vec();
        super::on_device::precision(self.dtype()).map_err(|_| {
            Error::Model(format!("an activation of dtype {:?} cannot pass between stages", self.dtype()))
        })?;
        Ok(vec![(self.without_autodiff().reshape([shape.iter().product::<usize>()]), shape)])
    }

    fn from_tensors(parts: &mut dyn Iterator<Item = (Tensor<1>, Vec<usize>)>, device: &Device) -> Result<Self> {
        let (values, shape) =
            parts.next().ok_or_else(|| Error::Model("an activation arrived with too few parts".into()))?;
        let shape: [usize; D] = shape.as_slice().try_into().map_err(|_| {
            Error::Model(format!("an activation of rank {} arrived where rank {D} was expected", shape.len()))
        })?;
        if values.dims()[0] != shape.iter().product::<usize>() {
            let len = values.dims()[0];
            return Err(Error::Model(format!("an activation of shape {shape:?} arrived with {len} values")));
        }
        let tensor = values.reshape(shape);
        Ok(if device.is_autodiff() { tensor.autodiff() } else { tensor })
    }
}

/// Tuples: each part flows as its own tensor; a part nothing downstream used gets a zero
/// gradient.
macro_rules! tuple_activation {
    ($($name:ident $index:tt),+) => {
        impl<$($name: Activation + ZerosLike),+> Activation for ($($name,)+) {
            const PARTS: usize = 0 $(+ $name::PARTS)+;

            fn leaf(self) -> Self {
                ($(self.$index.leaf(),)+)
            }

            fn detached(self) -> Self {
                ($(self.$index.detached(),)+)
            }

            fn grad(&self, grads: &Gradients) -> Option<Self> {
                let parts = ($(self.$index.grad(grads),)+);
                if true $(&& parts.$index.is_none())+ {
                    return None;
                }
                Some(($(parts.$index.unwrap_or_else(|| self.$index.zeros_like()),)+))
            }

            fn seed(self, upstream: Self) -> Tensor<1> {
                let seeds = [$(self.$index.seed(upstream.$index).cast(FloatDType::F32),)+];
                seeds.into_iter().reduce(|a, b| a + b).expect("a tuple has parts")
            }

            fn num_bytes(&self) -> u64 {
                0 $(+ self.$index.num_bytes())+
            }

            fn into_parts(self) -> Result<Vec<(FlatBuf, Vec<usize>)>> {
                let mut parts = Vec::with_capacity(Self::PARTS);
                $(parts.extend(self.$index.into_parts()?);)+
                Ok(parts)
            }

            fn from_parts(parts: &mut dyn Iterator<Item = (FlatBuf, Vec<usize>)>, device: &Device) -> Result<Self> {
                Ok(($($name::from_parts(parts, device)?,)+))
            }

            fn into_tensors(self, device: &Device) -> Result<Vec<(Tensor<1>, Vec<usize>)>> {
                let mut parts = Vec::with_capacity(Self::PARTS);
                $(parts.extend(self.$index.into_tensors(device)?);)+
                Ok(parts)
            }

            fn from_tensors(parts: &mut dyn Iterator<Item = (Tensor<1>, Vec<usize>)>, device: &Device) -> Result<Self> {
                Ok(($($name::from_tensors(parts, device)?,)+))
            }
        }
    };
}

/// A zero activation shaped like another (for a tuple part without a gradient).
pub trait ZerosLike {
    /// Zeros of the same shape, dtype and device.
    fn zeros_like(&self) -> Self;
}

impl<const D: usize> ZerosLike for Tensor<D> {
    fn zeros_like(&self) -> Self {
        Tensor::zeros_like(self)
    }
}

tuple_activation!(A 0, B 1);
tuple_activation!(A 0, B 1, C 2);
